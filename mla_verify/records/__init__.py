"""What a run leaves behind: reproducer and golden fixtures (safetensors + JSON, never pickles), the
failure summary printed for a person, and the Markdown/HTML/JSON/JUnit reports.

May import: core, problems, kinds. (tests/test_imports.py holds this rule.)
"""

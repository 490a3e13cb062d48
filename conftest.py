# Root conftest: the suite's pytest plugin is loaded through its pytest11 entry point once installed.

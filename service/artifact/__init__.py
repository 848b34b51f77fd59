"""Reading an artifact directory: its checked files, chat template and generation defaults."""

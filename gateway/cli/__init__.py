"""The `shapegate` command and its subcommands."""

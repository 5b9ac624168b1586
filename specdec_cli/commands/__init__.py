"""The command line: `run`, `bench`, `info`/`check`, and what they show."""

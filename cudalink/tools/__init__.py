"""The command line and its measuring tools (demo, info, monitor, bench with its peers, floors and
breakdown). Nothing in the library imports this package."""

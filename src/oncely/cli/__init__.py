"""The oncely command line."""

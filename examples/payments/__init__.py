"""The payments example: a service that moves money between accounts through oncely."""

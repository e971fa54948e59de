"""Example applications built on oncely."""

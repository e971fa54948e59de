"""Operator views shared by the CLI and HTTP: status, verify, republish; the AsyncAPI document."""

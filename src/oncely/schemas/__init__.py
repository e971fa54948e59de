"""Encoding events: single-object Avro, Confluent framing and JSON codecs, the committed schema
catalog and its compatibility checks. Import from the submodules (or from :mod:`oncely`)."""

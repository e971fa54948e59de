"""Event schemas: pydantic to Avro, the committed schema catalog, encodings and compatibility.

Import from the submodules (or from :mod:`oncely`); this package imports nothing so that
:mod:`oncely.events` can use :mod:`oncely.schemas.avro` without an import cycle.
"""

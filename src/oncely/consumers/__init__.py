"""The consuming side: effects applied once, and durable local tasks (:mod:`.tasks`)."""

"""Process runtime: endpoints layout, the service base, the local supervisor."""

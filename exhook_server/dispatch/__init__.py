"""Dispatch: trigger commands routed by VIN to a consistent-hashed worker pool."""

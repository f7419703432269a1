"""The two stores as the server sees them: each store's dispatch adapter and process model."""

"""Dispatch and instance jobs over PostgreSQL: vehicle state in the database, any instance
handles any vehicle."""

"""Shared utilities every part of ringdit uses: files written whole, dtypes by name, errors a user can act on,
configs and JSON read as data, named random streams."""

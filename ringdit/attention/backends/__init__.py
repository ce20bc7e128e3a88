"""The built-in attention backends. Importing this package registers them (in ``ringdit.attention``)."""

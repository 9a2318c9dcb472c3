"""Accounts: personal API tokens (a user's bearer token for the read-only JSON API) and their page."""

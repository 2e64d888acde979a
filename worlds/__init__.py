"""The embedded worlds: tiny synthetic tasks with exact judges, and the from-scratch models they train."""

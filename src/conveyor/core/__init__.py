"""Pure-Python scheduling core: requests, KV block bookkeeping, policies, the scheduler.

Nothing here imports torch, so every part is testable in milliseconds.
"""

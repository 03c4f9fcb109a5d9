"""Ways in: `LLM` (offline), `AsyncLLM` (asyncio streams), and the engine thread or engine
process behind AsyncLLM (both an `EngineClient`). Imported lazily by `conveyor.__init__`.
"""

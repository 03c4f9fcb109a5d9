"""Torch side of conveyor: checkpoint loading, decoder modules, paged attention, sampling."""

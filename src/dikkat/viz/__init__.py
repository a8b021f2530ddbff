"""Pictures: loss curves, attention heat maps. Uses matplotlib's file backend (no screen)."""

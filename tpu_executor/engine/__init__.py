"""The engine loop, its options and its stats snapshot."""

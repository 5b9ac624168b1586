"""The llama.cpp layer: the ctypes wrapper (models, contexts, sequences, batches), the
build's backends and devices, the CPU probe, and the machine's facts. Nothing above it
touches ctypes."""

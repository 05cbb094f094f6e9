"""How bytes move: liburing bindings, the ring thread, storage targets and aligned buffers."""

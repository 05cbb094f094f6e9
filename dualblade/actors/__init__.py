"""Who moves it: budgeter, binder, copy-thread, GPU-DMA and strategy-probe actors."""

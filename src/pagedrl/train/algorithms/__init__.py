"""One module per algorithm and its batch layout: what it trains on, its loss, its metrics."""

"""perftest (ib_write_bw, ib_send_bw, ib_write_lat) on rxe devices: python -m agents.perftest."""

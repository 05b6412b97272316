"""Workers: aggregated (prefill + decode), prefill, decode."""

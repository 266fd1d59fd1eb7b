"""Mixture-of-experts layers: the eligibility oracle, the torch reference and the kernel backends."""

"""Node agent: `keepwarm cache serve --report-to-kubernetes` follows a WeightCache and reports a
WeightCacheNode. Needs the `kubernetes` extra (pip install 'keepwarm-runtime[kubernetes]')."""

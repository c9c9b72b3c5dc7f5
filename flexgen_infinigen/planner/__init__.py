"""Planning a policy: hardware profiles, a cost model, and the placement optimizer."""

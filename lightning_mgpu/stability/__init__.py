"""Training stability: NaNSkip (non-finite and spike skips, rollback, device-side skips), GradientClipping, EMA."""

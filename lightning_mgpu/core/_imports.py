"""Optional dependencies, checked in one place without importing them."""

from lightning_utilities.core.imports import RequirementCache

MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")
PROMETHEUS_AVAILABLE = RequirementCache("prometheus-client>=0.17")

"""Build hook for llmgw-agent: of the agents package, ship only what the node runs.

agents/ is also the control plane's Django app (views, models, migrations);
a node gets its __init__ and agents/node/ (the wire schema is the `wire`
package of its own), never the Django modules, so nothing installed on a node
can import Django by accident.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

AGENT_MODULES_OF_AGENTS = {"__init__"}


class AgentBuildPy(build_py):
    """build_py that drops the control plane's modules from the `agents` package."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        """The package's modules, less the control plane's when the package is `agents`."""
        modules = super().find_package_modules(package, package_dir)
        if package != "agents":
            return modules
        return [m for m in modules if m[1] in AGENT_MODULES_OF_AGENTS]


setup(cmdclass={"build_py": AgentBuildPy})

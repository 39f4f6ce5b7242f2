"""The rule pages in the wheel: ``docs/rules/*.md`` is copied to ``safetorch/_docs/rules`` when the package is
built, so that ``safetorch explain ST003`` reads the same page as the repository shows. Everything else is in
pyproject.toml."""

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithRulePages(build_py):
    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "safetorch", "_docs", "rules")
        self.mkpath(target)
        for page in sorted(glob.glob(os.path.join("docs", "rules", "*.md"))):
            self.copy_file(page, os.path.join(target, os.path.basename(page)))


setup(cmdclass={"build_py": BuildWithRulePages})

from setuptools import find_packages, setup

setup(
    name="mt_dualpipe",
    version="0.1.0",
    description="DualPipe and Zero-Bubble pipeline parallelism for PyTorch: schedule compiler, runtime, diagrams",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mt_dualpipe", "mt_dualpipe.*"]),
    package_data={"mt_dualpipe.planner": ["models/*.json"]},
    install_requires=["torch>=2.4", "numpy", "rich", "graphviz"],
    extras_require={"test": ["pytest", "hypothesis"], "dev": ["ruff", "pytest", "hypothesis"]},
    entry_points={"console_scripts": ["mt-dualpipe=mt_dualpipe.cli:main"]},
)

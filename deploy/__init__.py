"""Deployment files of shapegate, and the tools that run or check them without a container engine."""

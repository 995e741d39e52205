# lit configuration of dcplan's golden tests: RUN lines call the built tools,
# CHECK lines (FileCheck) pin their output and error messages.
import os

import lit.formats

config.name = "dcplan"
# bash, so that RUN lines can use pipes and redirections as written.
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".test"]
config.excludes = ["Inputs"]
config.test_source_root = os.path.dirname(__file__)
config.test_exec_root = os.path.join(config.dcplan_binary_dir, "tests", "lit")

config.environment["PATH"] = os.pathsep.join(
    [config.dcplan_tools_dir, config.llvm_tools_dir, config.environment.get("PATH", os.environ["PATH"])])
# Golden output must not depend on the terminal or the locale.
config.environment["LC_ALL"] = "C"
config.environment["COLUMNS"] = "100"
config.substitutions.append(("%python", config.python_executable))
config.substitutions.append(("%inputs", os.path.join(config.test_source_root, "Inputs")))
config.substitutions.append(("%examples", os.path.join(config.dcplan_source_dir, "examples")))
config.substitutions.append(
    ("%expect-exit", config.python_executable + " " + os.path.join(config.test_source_root, "expect_exit.py")))
if config.dcplan_sanitized:
    config.available_features.add("asan")

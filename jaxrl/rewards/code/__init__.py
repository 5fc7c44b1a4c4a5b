"""jaxrl.rewards.code: the `code_tests` reward (`tests`): judge, harness, test formats, wire."""

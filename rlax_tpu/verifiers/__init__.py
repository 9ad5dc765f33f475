"""Verifier service: sandboxed (bubblewrap) code execution, Codeforces-style checkers, math answers."""

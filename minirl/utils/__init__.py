"""minirl.utils: I/O, validation, seeding and command-line plumbing (hand-written; they teach nothing)."""

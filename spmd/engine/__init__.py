"""What runs inside every rank. Imports nothing from cluster/, magics/ or kernel/."""

"""placeholder"""
ROWS = 64
ALIGN = 64

"""Unit conversions for people: records hold seconds and joules, reports show hours and kWh."""

SECONDS_PER_HOUR = 3600.0
JOULES_PER_KWH = 3.6e6

//go:build race && !js

package client

// rtcRaceEnabled scales the RTC tests down under the race detector, which slows pion's DTLS and
// SCTP about tenfold.
const rtcRaceEnabled = true

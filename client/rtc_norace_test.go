//go:build !race && !js

package client

const rtcRaceEnabled = false

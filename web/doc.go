// Package web will embed the static assets (go:embed): the contributor page and the admin
// dashboard. No build step is needed to run the binary.
package web

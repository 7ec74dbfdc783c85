package web_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/shoal-ml/shoal/web"
)

// The coordinator serves the dashboard under /admin/ (behind its admin check, left out here) and
// the sign-in form at /admin/login.
func ExampleAdmin() {
	mux := http.NewServeMux()
	mux.Handle("GET /admin/", http.StripPrefix("/admin", http.FileServerFS(web.Admin())))
	mux.HandleFunc("GET /admin/login", func(w http.ResponseWriter, r *http.Request) {
		msg := ""
		if r.URL.Query().Get("error") != "" {
			msg = "That token is wrong."
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Security-Policy", web.LoginCSP())
		w.Write(web.LoginPage(msg))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for _, path := range []string{"/admin/", "/admin/admin.js", "/admin/admin.css", "/admin/login?error=1"} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			fmt.Println(err)
			return
		}
		resp.Body.Close()
		fmt.Println(path, resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	// Output:
	// /admin/ 200 text/html; charset=utf-8
	// /admin/admin.js 200 text/javascript; charset=utf-8
	// /admin/admin.css 200 text/css; charset=utf-8
	// /admin/login?error=1 200 text/html; charset=utf-8
}

"""A stand-in for the Hugging Face Hub (which cannot be reached from the tests), speaking the
routes the Hub's clients use: `GET /api/models/{repo}/revision/{revision}` (the commit and its
files) and `GET|HEAD /{repo}/resolve/{revision}/{file}` (the file, with `Range`, `ETag`,
`X-Repo-Commit` and `Content-Range` as the Hub sends them). It serves the directories under
--root as repositories `org/name`, each at one commit named by its content, and logs each
request line to --log.

    python hub_double.py --root DIR --port-file FILE --log FILE
"""

import argparse
import hashlib
import http.server
import json
import os
import re
import urllib.parse


def files_of(repo_dir):
    out = []
    for base, dirs, names in os.walk(repo_dir):
        dirs.sort()
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = os.path.join(base, name)
            out.append(os.path.relpath(path, repo_dir))
    return sorted(out)


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def commit_of(repo_dir):
    digest = hashlib.sha1()
    for name in files_of(repo_dir):
        digest.update(name.encode())
        digest.update(sha256_of(os.path.join(repo_dir, name)).encode())
    return digest.hexdigest()


class Hub(http.server.BaseHTTPRequestHandler):
    root = "."
    log_file = None

    def log_message(self, fmt, *args):
        if self.log_file:
            with open(self.log_file, "a") as f:
                f.write(f"{self.command} {self.path}\n")

    def repo(self, org, name):
        repo_dir = os.path.join(self.root, org, name)
        return repo_dir if os.path.isdir(repo_dir) else None

    def send_json(self, status, value):
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def not_found(self, message):
        self.send_json(404, {"error": message})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        info = re.fullmatch(r"/api/models/([^/]+)/([^/]+)/revision/(.+)", path)
        resolve = re.fullmatch(r"/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)", path)
        if info:
            org, name, revision = info.groups()
            repo_dir = self.repo(org, name)
            if repo_dir is None:
                return self.not_found("Repository Not Found")
            commit = commit_of(repo_dir)
            if revision not in ("main", commit):
                return self.not_found("Revision Not Found")
            return self.send_json(200, {
                "id": f"{org}/{name}",
                "sha": commit,
                "siblings": [{"rfilename": f} for f in files_of(repo_dir)],
            })
        if resolve:
            org, name, revision, file_name = resolve.groups()
            repo_dir = self.repo(org, name)
            if repo_dir is None:
                return self.not_found("Repository Not Found")
            commit = commit_of(repo_dir)
            file_path = os.path.join(repo_dir, file_name)
            if revision not in ("main", commit) or file_name not in files_of(repo_dir):
                return self.not_found("Entry Not Found")
            size = os.path.getsize(file_path)
            start, end = 0, size - 1
            ranged = self.headers.get("Range")
            if ranged:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", ranged.strip())
                start = int(m.group(1))
                end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{sha256_of(file_path)}"')
            self.send_header("Content-Length", str(end - start + 1))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if self.command != "HEAD":
                with open(file_path, "rb") as f:
                    f.seek(start)
                    self.wfile.write(f.read(end - start + 1))
            return
        self.not_found("Not Found")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--log")
    args = parser.parse_args()
    Hub.root = args.root
    Hub.log_file = args.log
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()

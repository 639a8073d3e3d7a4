//! The built-in object store (`file://DIR`, the embedded default): GET,
//! HEAD, PUT and DELETE on files under DIR.
//!
//! A PUT streams into a temporary file, fsyncs it, tags it with the
//! fencing token (extended attribute `user.fencegate.token`), then — under
//! a per-object lock that also evaluates `If-Match` / `If-None-Match` —
//! renames it into place and fsyncs the directory. A reader sees the old
//! object or the new one, never a mix; after a crash, the object is either
//! the acknowledged one or the one before it. No path leaves DIR: the
//! proxy has already refused `..`, `.` and encoded separators, and every
//! existing component is checked not to be a symlink. `DIR/.fencegate`
//! holds temporary files and is not addressable.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use futures_util::TryStreamExt;
use http::request::Parts;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::fenced_body::FencedBody;
use super::upstream::UpstreamRequest;
use crate::body::{empty, BoxBody};
use crate::error::Error;

const RESERVED: &str = ".fencegate";
const TOKEN_XATTR: &str = "user.fencegate.token";
const STRIPES: usize = 64;

/// The object store rooted at one directory.
#[derive(Clone)]
pub struct FileStore {
    root: PathBuf,
    stripes: Arc<[tokio::sync::Mutex<()>]>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "file://{}", self.root.display())
    }
}

/// `fut` unless `deadline` passes first (then the route's timeout error;
/// its `timeout_ms` is filled in by the proxy).
async fn within<T>(deadline: Instant, fut: impl std::future::Future<Output = T>) -> Result<T, Error> {
    tokio::time::timeout_at(deadline, fut).await.map_err(|_| Error::UpstreamTimeout { timeout_ms: 0 })
}

fn io<'a>(what: &'a str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |e| Error::Internal(format!("{what} {}: {e}", path.display()))
}

impl FileStore {
    /// Creates DIR (and its temp folder) if needed.
    pub fn open(dir: &Path) -> Result<FileStore, Error> {
        std::fs::create_dir_all(dir.join(RESERVED).join("tmp")).map_err(io("creating", dir))?;
        let root = dir.canonicalize().map_err(io("resolving", dir))?;
        let stripes = (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect();
        Ok(FileStore { root, stripes })
    }

    /// Serves one request for object `name` (the checked, decoded path).
    pub async fn handle(
        &self,
        req: UpstreamRequest,
        name: &str,
        token: Option<u64>,
        deadline: Instant,
    ) -> Result<Response<BoxBody>, Error> {
        let path = self.resolve(name)?;
        let (parts, body) = req.into_parts();
        match parts.method {
            Method::GET | Method::HEAD => within(deadline, self.get(&parts, &path)).await?,
            Method::PUT => self.put(&parts, body, name, &path, token, deadline).await,
            Method::DELETE => self.delete(&parts, name, &path, deadline).await,
            ref m => Err(Error::MethodNotAllowed(m.to_string())),
        }
    }

    fn resolve(&self, name: &str) -> Result<PathBuf, Error> {
        if name.is_empty() || name.ends_with('/') {
            return Err(Error::BadRequest("the built-in store holds objects, not directories".into()));
        }
        if name == RESERVED || name.starts_with(".fencegate/") {
            return Err(Error::BadRequest(format!("{RESERVED} is reserved")));
        }
        let mut path = self.root.clone();
        for seg in name.split('/') {
            path.push(seg);
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(Error::BadRequest("the object path crosses a symlink".into()))
                }
                _ => {}
            }
        }
        Ok(path)
    }

    fn stripe(&self, name: &str) -> &tokio::sync::Mutex<()> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        name.hash(&mut h);
        &self.stripes[(h.finish() as usize) % STRIPES]
    }

    async fn get(&self, req: &Parts, path: &Path) -> Result<Response<BoxBody>, Error> {
        let file = match tokio::fs::File::open(path).await {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_found()),
            Err(e) => return Err(io("opening", path)(e)),
        };
        let meta = file.metadata().await.map_err(io("reading", path))?;
        if !meta.is_file() {
            return Err(not_found());
        }
        let etag = etag_of(&meta);
        let current = Some(etag.as_str());
        if let Some(inm) = req.headers.get(header::IF_NONE_MATCH) {
            if etag_matches(inm, current) {
                let mut resp = Response::new(empty());
                *resp.status_mut() = StatusCode::NOT_MODIFIED;
                insert(resp.headers_mut(), header::ETAG, &etag);
                return Ok(resp);
            }
        }
        check_if_match(&req.headers, current)?;
        let token = read_token(&file).await;
        let len = meta.len();
        let body = if req.method == Method::HEAD {
            empty()
        } else {
            let stream = tokio_util::io::ReaderStream::with_capacity(file, 64 * 1024)
                .map_ok(http_body::Frame::data)
                .map_err(|e| -> crate::body::BoxError { Box::new(e) });
            StreamBody::new(stream).boxed_unsync()
        };
        let mut resp = Response::new(body);
        let h = resp.headers_mut();
        insert(h, header::ETAG, &etag);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        if let Some(t) = token {
            h.insert("x-fencing-token", HeaderValue::from(t));
        }
        Ok(resp)
    }

    async fn put(
        &self,
        parts: &Parts,
        body: FencedBody,
        name: &str,
        path: &Path,
        token: Option<u64>,
        deadline: Instant,
    ) -> Result<Response<BoxBody>, Error> {
        let tmp = self.root.join(RESERVED).join("tmp").join(crate::authority::types::new_lease_id()?);
        // The deadline covers the body and the wait for the object; from
        // the lock on, the commit runs to its end (see `Upstream::send`).
        let written = within(deadline, write_body(&tmp, body, token)).await.and_then(|w| w);
        if let Err(e) = written {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
        let _held = match within(deadline, self.stripe(name).lock()).await {
            Ok(held) => held,
            Err(e) => {
                let _ = tokio::fs::remove_file(&tmp).await;
                return Err(e);
            }
        };
        let existing = tokio::fs::metadata(path).await.ok().filter(std::fs::Metadata::is_file);
        let current = existing.as_ref().map(etag_of);
        let check = check_if_match(&parts.headers, current.as_deref()).and_then(|()| {
            match parts.headers.get(header::IF_NONE_MATCH) {
                Some(inm) if etag_matches(inm, current.as_deref()) => {
                    Err(Error::PreconditionFailed("If-None-Match: the object exists".into()))
                }
                _ => Ok(()),
            }
        });
        if let Err(e) = check {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
        let parent = path.parent().unwrap_or(&self.root).to_path_buf();
        tokio::fs::create_dir_all(&parent).await.map_err(io("creating", &parent))?;
        // Re-check after creating directories: none may be a symlink.
        self.resolve(name)?;
        tokio::fs::rename(&tmp, path).await.map_err(io("renaming into", path))?;
        sync_dir(&parent).await?;
        let meta = tokio::fs::metadata(path).await.map_err(io("reading", path))?;
        let mut resp = Response::new(empty());
        *resp.status_mut() = if existing.is_some() { StatusCode::OK } else { StatusCode::CREATED };
        insert(resp.headers_mut(), header::ETAG, &etag_of(&meta));
        Ok(resp)
    }

    async fn delete(
        &self,
        req: &Parts,
        name: &str,
        path: &Path,
        deadline: Instant,
    ) -> Result<Response<BoxBody>, Error> {
        let _held = within(deadline, self.stripe(name).lock()).await?;
        let Some(meta) = tokio::fs::metadata(path).await.ok().filter(std::fs::Metadata::is_file) else {
            return Err(not_found());
        };
        check_if_match(&req.headers, Some(&etag_of(&meta)))?;
        tokio::fs::remove_file(path).await.map_err(io("removing", path))?;
        sync_dir(path.parent().unwrap_or(&self.root)).await?;
        let mut resp = Response::new(empty());
        *resp.status_mut() = StatusCode::NO_CONTENT;
        Ok(resp)
    }
}

fn not_found() -> Error {
    Error::NotFound("no such object".into())
}

fn insert(h: &mut HeaderMap, name: header::HeaderName, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        h.insert(name, v);
    }
}

/// Streams the body into `tmp`, fsyncs it and tags it with the token.
async fn write_body(tmp: &Path, mut body: FencedBody, token: Option<u64>) -> Result<(), Error> {
    let mut file = tokio::fs::File::create(tmp).await.map_err(io("creating", tmp))?;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Error::UpstreamUnavailable(format!("request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            let data: Bytes = data;
            file.write_all(&data).await.map_err(io("writing", tmp))?;
        }
    }
    file.flush().await.map_err(io("writing", tmp))?;
    let std_file = file.into_std().await;
    let tmp_owned = tmp.to_path_buf();
    tokio::task::spawn_blocking(move || -> Result<(), Error> {
        if let Some(t) = token {
            // Best effort: a filesystem without user xattrs still stores the
            // object; GET then carries no token header.
            if let Err(e) =
                rustix::fs::fsetxattr(&std_file, TOKEN_XATTR, t.to_string().as_bytes(), rustix::fs::XattrFlags::empty())
            {
                tracing::debug!(error = %e, "cannot tag object with its fencing token");
            }
        }
        std_file.sync_all().map_err(io("fsyncing", &tmp_owned))
    })
    .await
    .map_err(|e| Error::Internal(format!("fsync task: {e}")))?
}

async fn read_token(file: &tokio::fs::File) -> Option<u64> {
    let f = file.try_clone().await.ok()?.into_std().await;
    tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 32];
        let n = rustix::fs::fgetxattr(&f, TOKEN_XATTR, &mut buf).ok()?;
        std::str::from_utf8(buf.get(..n)?).ok()?.parse().ok()
    })
    .await
    .ok()
    .flatten()
}

async fn sync_dir(dir: &Path) -> Result<(), Error> {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        std::fs::File::open(&dir).and_then(|d| d.sync_all()).map_err(io("fsyncing", &dir))
    })
    .await
    .map_err(|e| Error::Internal(format!("fsync task: {e}")))?
}

/// Strong ETag from modification time and size (as nginx does).
fn etag_of(meta: &std::fs::Metadata) -> String {
    let nanos = meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(0, |d| d.as_nanos());
    format!("\"{nanos:x}-{:x}\"", meta.len())
}

/// True when an `If-Match`/`If-None-Match` list names `current` (or is
/// `*` and the object exists).
fn etag_matches(list: &HeaderValue, current: Option<&str>) -> bool {
    let Some(current) = current else { return false };
    let Ok(text) = list.to_str() else {
        return false;
    };
    text.split(',').map(str::trim).any(|t| t == "*" || t.trim_start_matches("W/") == current)
}

fn check_if_match(headers: &HeaderMap, current: Option<&str>) -> Result<(), Error> {
    match headers.get(header::IF_MATCH) {
        Some(im) if !etag_matches(im, current) => {
            Err(Error::PreconditionFailed("If-Match does not match the object".into()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etag_lists_match() {
        let v = HeaderValue::from_static("\"a\", \"b\"");
        assert!(etag_matches(&v, Some("\"b\"")));
        assert!(!etag_matches(&v, Some("\"c\"")));
        assert!(etag_matches(&HeaderValue::from_static("*"), Some("\"c\"")));
        assert!(!etag_matches(&HeaderValue::from_static("*"), None));
    }

    #[test]
    fn reserved_and_directory_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::open(dir.path()).unwrap();
        assert!(s.resolve(".fencegate/tmp/x").is_err());
        assert!(s.resolve("dir/").is_err());
        assert!(s.resolve("").is_err());
        assert!(s.resolve("a/b").is_ok());
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_out_of_the_root_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let s = FileStore::open(dir.path()).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("escape")).unwrap();
        assert!(s.resolve("escape/passwd").is_err());
    }
}

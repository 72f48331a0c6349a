//! Reading the config file: its settings, and the line each one is on, so that every error about
//! the file says where to look.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::de::IgnoredAny;
use toml::Spanned;

use crate::settings::ServeSettings;

/// The config file, read.
#[derive(Debug)]
pub(crate) struct ConfigFile {
    path: PathBuf,
    text: String,
    /// The line of each top-level setting.
    lines: BTreeMap<String, usize>,
}

/// Something wrong with the config file: `idem serve` exits 2 with it, as for a bad flag.
#[derive(Debug, thiserror::Error)]
#[error("{}{}: {message}", path.display(), line.map(|line| format!(" line {line}")).unwrap_or_default())]
pub(crate) struct ConfigError {
    path: PathBuf,
    line: Option<usize>,
    message: String,
}

impl ConfigFile {
    /// Reads and parses `path` into the settings it gives; an unknown setting or a bad value is
    /// an error with its line.
    pub(crate) fn read(path: &Path) -> Result<(Self, ServeSettings), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError {
            path: path.to_owned(),
            line: None,
            message: format!("cannot read it: {err}"),
        })?;
        let mut file = Self {
            path: path.to_owned(),
            text,
            lines: BTreeMap::new(),
        };
        let settings = toml::from_str(&file.text).map_err(|err| file.parse_error(&err))?;
        let keys: BTreeMap<Spanned<String>, IgnoredAny> =
            toml::from_str(&file.text).map_err(|err| file.parse_error(&err))?;
        file.lines = keys
            .into_keys()
            .map(|key| (key.get_ref().clone(), file.line_at(key.span().start)))
            .collect();
        Ok((file, settings))
    }

    /// An error about the file at a byte offset.
    pub(crate) fn error_at(&self, offset: usize, message: String) -> ConfigError {
        ConfigError {
            path: self.path.clone(),
            line: Some(self.line_at(offset)),
            message,
        }
    }

    /// An error about a top-level setting of the file.
    pub(crate) fn error_about(&self, setting: &str, reason: &str) -> ConfigError {
        ConfigError {
            path: self.path.clone(),
            line: self.lines.get(setting).copied(),
            message: format!("{setting}: {reason}"),
        }
    }

    /// The 1-based line of a byte offset.
    fn line_at(&self, offset: usize) -> usize {
        let offset = offset.min(self.text.len());
        self.text.as_bytes()[..offset].iter().filter(|&&b| b == b'\n').count() + 1
    }

    /// A parse error, with its line and, for a bad value, the setting it is for.
    fn parse_error(&self, err: &toml::de::Error) -> ConfigError {
        let Some(span) = err.span() else {
            return ConfigError {
                path: self.path.clone(),
                line: None,
                message: err.message().to_owned(),
            };
        };
        let line = self.line_at(span.start);
        // A value's error is on its key's line, `key = value`: name the key, unless the message
        // already does (an unknown setting, a missing one).
        let text = self.text.lines().nth(line - 1).unwrap_or_default();
        let key = text
            .split_once('=')
            .map(|(key, _)| key.trim())
            .filter(|key| !key.is_empty() && !err.message().contains(&format!("`{key}`")));
        let message = match key {
            Some(key) => format!("{key}: {}", err.message()),
            None => err.message().to_owned(),
        };
        ConfigError {
            path: self.path.clone(),
            line: Some(line),
            message,
        }
    }
}

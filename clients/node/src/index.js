'use strict';
// Public entry point of the ShardLM Node.js client.
const { ShardLMClient, ShardLMError, status } = require('./client');
const { decodeStatus } = require('./status');

module.exports = { ShardLMClient, ShardLMError, status, decodeStatus };
